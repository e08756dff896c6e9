"""Stand-ins for the real parts the tests start where those parts are not the subject of a test.

``standins.trainer``: the trainer (and torchrun) without torch, stepping only when the test says so.
"""
