"""Shared pytest settings."""

from hypothesis import HealthCheck, settings

pytest_plugins = ["datamover.testing.hosts"]  # the test_hosts fixture

settings.register_profile("default", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("default")
