"""``torchvitals demo``: everything torchvitals does, on a laptop, in under two minutes.

    torchvitals demo --fault lr-spike|nan|frozen|none --ranks 2 --steps 150 --out DIR

``launch`` spawns the CPU ranks and watches them, ``train`` is one rank's loop with the injected
fault, ``data`` the bundled text (package data) and synthetic token batches, ``model`` the small
GPT (which the examples, tests and benchmarks train on the synthetic batches).
"""
