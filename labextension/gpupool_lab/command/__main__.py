"""``python -m gpupool_lab.command``: the ``gpupool`` command."""

from gpupool_lab.command.main import main

raise SystemExit(main())
