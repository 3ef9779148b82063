"""The admin HTTP port: debug endpoints, the explain API and the status page."""
