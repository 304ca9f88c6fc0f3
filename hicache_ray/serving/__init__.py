"""The serving front without Ray: OpenAI bodies and text (``openai/``), serve options, the
router's cache index. May import ``base``, ``cache`` (events) and the engine's public parts
(``request``, ``spec``, ``model``), never its runtime.
"""
