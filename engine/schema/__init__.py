"""The journal's schema as code: step events (:mod:`.events`) and samples (:mod:`.sample`).

The codec boundary: records are read and written by key here and nowhere else in the engine.
"""
