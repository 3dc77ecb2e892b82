"""Several replicas as one fleet: which replica a request goes to (router.py, on Serve's RequestRouter
API, in the ingress's process), what a replica reports to Serve's autoscaler (load.py) and how the
autoscaler turns it into a replica count (autoscaling.py, in Serve's controller). Torch-free: the
ingress and the controller import this folder; it imports only ray.serve, service.messages and the
standard library."""
