"""Integrations of remat with other libraries (imported on demand)."""
