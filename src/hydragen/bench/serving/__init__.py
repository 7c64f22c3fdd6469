"""``hydragen serve`` over HTTP under a shared-prefix request load, prefix cache on and off
(``bench serve``)."""
