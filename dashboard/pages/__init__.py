"""One module per page: ``layout(config)`` builds the page, ``register(app, config)`` its callbacks."""
