"""vpage on Ray Serve (``vpage serve --ray-serve``): engine replicas placed, scaled and
health-checked by Ray Serve, routed by prompt prefix, behind vpage's own OpenAI app."""

from vpage.entrypoints.ray_serve.app import build_app

__all__ = ["build_app"]
