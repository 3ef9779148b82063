"""Built-in scheduler plugins, one module each; ``extproc.scheduling.registry`` lists them."""
