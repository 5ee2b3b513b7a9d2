"""What an iteration draws and from which law: every random number as a counter hash (`murmur`,
`streams`), the filtered joint distributions and their draws (`distributions`), a layer's
candidate table (`candidates`), and where the host may read a device value (`host_reads`).
Imports nothing else of the algorithm but the scorer protocol's door."""
