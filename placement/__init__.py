"""Pure planning of TP x PP bundles and rank order, plus one module that creates groups.

Empty until the Ray-layer issue; the package ships now so the distribution's layout is final.
"""

__all__: list[str] = []
