"""Scheduling: filters and weighted score plugins rank the pods for one request."""
