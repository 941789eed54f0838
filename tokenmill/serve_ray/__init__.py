"""tokenmill on Ray Serve (`pip install 'tokenmill[ray]'`, `tokenmill serve-ray`):
replicas that each run one AsyncEngine, an ingress that forwards the OpenAI routes
to them, and a request router that keeps prompts sharing a prefix on one replica.

app.py builds the application, replica.py is a replica, ingress.py the ingress,
router.py the routing, run.py the command."""
