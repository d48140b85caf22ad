"""The chat pages: static HTML, CSS and JavaScript modules, served by ``server.pages``."""
