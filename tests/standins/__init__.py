"""Stand-ins for the real parts the tests start where those parts are not the subject of a test.

``standins.trainer``: the trainer (and torchrun) without torch, stepping only when the test says so.
``standins.torchrun_lite``: a torchrun without torch, for the real trainer's tests whose subject is
not torchrun.
"""
