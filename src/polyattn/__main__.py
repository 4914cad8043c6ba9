from polyattn.cli import main

raise SystemExit(main())
