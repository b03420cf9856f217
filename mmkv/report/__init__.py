"""Tables, plots and the HTML gallery from run folders."""
