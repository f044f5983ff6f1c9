"""Server side: the ServerApp, strategy construction and run results."""
