"""Pictures of what remat measures: memory over one step (``remat.memory.plot``, ``remat memory``).

Nothing is imported here, so that ``remat.memory`` can import the plot without a cycle; matplotlib
itself is imported only when a figure is drawn.
"""
