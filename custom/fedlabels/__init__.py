"""fedlabels: federated learning for medical imaging when every hospital labels differently."""

# The one place the release's version is written (setup.cfg reads it; CHANGELOG.md names it).
__version__ = "0.1.0"
