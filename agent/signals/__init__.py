"""The vital signs as vertical slices: each module packs one signal, reads it back, and names
its rules and metrics (see ``base.py``). The step calls them in the order ``agent.py`` lists."""
