"""What every benchmark shares: result tables and their JSON, the machine and its measured rates, the
plots' look."""
