package main

import (
	"math"
	"slices"
	"time"
)

// percentile is the nearest-rank p-th percentile (0 < p ≤ 1) of d, which it
// sorts.
func percentile(d []time.Duration, p float64) time.Duration {
	if len(d) == 0 {
		return 0
	}
	slices.Sort(d)
	rank := int(math.Ceil(p*float64(len(d)))) - 1
	return d[max(0, min(rank, len(d)-1))]
}

// median of xs (the mean of the middle two for an even count); it sorts a
// copy.
func median(xs []float64) float64 {
	if len(xs) == 0 {
		return math.NaN()
	}
	s := slices.Clone(xs)
	slices.Sort(s)
	n := len(s)
	if n%2 == 1 {
		return s[n/2]
	}
	return (s[n/2-1] + s[n/2]) / 2
}

// micros is d in µs.
func micros(d time.Duration) float64 { return float64(d) / float64(time.Microsecond) }
