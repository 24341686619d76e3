"""Training entry points and the CPU adaptations they apply.

Importing ``train`` first (train.py, launch.*, train.data) raises the cyclic GC's young-generation
threshold from 700 allocations to 50,000: importing torch and torchtitan makes about a million
objects that live for the whole process, and the collections that the default threshold runs over
them took ~0.5 s of a rank's ~4.5 s start. Training itself is unaffected: torchtitan's trainer turns
automatic collection off and collects every ``gc_freq`` steps.
"""

import gc

gc.set_threshold(50_000, *gc.get_threshold()[1:])
