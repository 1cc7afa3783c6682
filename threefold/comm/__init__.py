"""Communication: the counted layer every collective goes through, the mesh, process groups,
the check that every rank issues the same collectives, nodes, heartbeats and faults.
"""
