"""Molt Studio web app: dashboard, REST API and the `molt` command line."""
