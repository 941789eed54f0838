"""`tokenmill simulate`: the real core/ scheduler on a simulated clock.

The simulator (simulator.py) drives core's Scheduler / StaticBatchScheduler and
KVCacheManager themselves, with a step-cost model (cost_model.py) in place of
the model runner; calibrate.py fits that model on this machine through the real
engine, and plan.py searches engine settings and replica counts against SLOs.
Only calibrate.py imports torch (through the engine); the rest needs numpy at most.
"""
