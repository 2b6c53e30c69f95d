"""What is where, for people: ``report`` assembles the memory report (devices, RAM, models, memory mode) as
text and JSON; ``push`` is the thread that sends snapshots to the live panel while anyone listens.
"""
