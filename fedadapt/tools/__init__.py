"""Tools around the app: the ``fedadapt`` and ``fedadapt-exp`` commands.

``deploy`` starts and stops Flower's processes (SuperLink, SuperNodes,
containers); ``submission`` submits a run to a SuperLink and follows it to its
real outcome; ``cli`` and ``experiments`` are the two commands built on them.
"""
