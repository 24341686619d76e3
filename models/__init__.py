"""Model definitions. Each model lives in its own package, in torchtitan's layout."""
