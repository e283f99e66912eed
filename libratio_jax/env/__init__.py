"""Functional multi-agent environment (gymnax conventions). Not built yet: see the issues."""
