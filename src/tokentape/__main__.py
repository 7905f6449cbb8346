from tokentape.cli import main

main()
