"""The journal's schema as code: step events (:mod:`.events`) and samples (:mod:`.sample`).

The codec boundary: records are read and written by key here and nowhere else in the engine.
Importing this package declares verlj's event types to the journal (:mod:`.events`).
"""

from . import events as events  # declares the step's event types to the journal's registry
