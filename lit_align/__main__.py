from lit_align.cli import main

main()
