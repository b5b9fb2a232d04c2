"""The stream job on Faust: Faust agents drive the window engine, on a consumer made not to skip
messages across rebalances."""
