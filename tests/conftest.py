"""Session-wide test settings."""

from service.ray_env import use_fast_path

# Ray Serve's request path as `python -m service` runs it (service/ray_env.py); every Ray process a
# test starts inherits it.
use_fast_path()
