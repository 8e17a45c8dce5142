"""From screen to submission: after a short screen, ``promote`` reruns the best configurations as seed
replicates at the full budget, and ``export`` writes one as a self-contained competition submission
(``bundle`` packs the trainer's code into it behind ``bundle_boot``'s import hook). ``replay`` re-runs a
recorded study's decisions under another sampler and pruner, at no compute.
"""
