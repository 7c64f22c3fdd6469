"""Many questions about one long document, prefix sharing on and off (``bench longdoc``)."""
