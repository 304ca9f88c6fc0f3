"""Ray actors (thin wrappers over the core): rank actors, object-store L3 owners, Deployment.

Empty until the Ray-layer issue; the package ships now so the distribution's layout is final.
"""

__all__: list[str] = []
