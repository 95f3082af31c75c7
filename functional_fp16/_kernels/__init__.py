"""The compiled kernels and their declared arguments; nothing here imports the rest of the package."""
