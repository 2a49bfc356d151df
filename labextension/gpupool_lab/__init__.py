"""gpupool's notebook side: runs in the user's server (never imports the hub package ``gpupool``).

It holds the notebook-to-script converter, the DDP runtime helper used inside jobs
(``gpupool_lab.ddp``), the one hub API client, and the ``gpupool`` command line.
"""
