# CPU kernels of vpage_core (owned by the kernels work; sources and per-ISA flags go here).
