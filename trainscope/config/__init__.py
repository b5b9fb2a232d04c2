"""Configuration: documented environment variable names (``env``), settings resolved once per
command (``settings``), and keeping secrets out of URLs, errors and logs (``secrets``)."""
