"""The prepared GPU check (`make gpu-check`): loadtests/gpu/check.py."""
