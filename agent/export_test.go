package agent

import "github.com/gpu-agent/gpu-agent/plugin/topology"

// scorerForTest reads the cached scorer; only safe once Run has published
// (the test reads it after, with no reconcile in flight).
func (a *Agent) scorerForTest() *topology.Scorer { return a.scorerCache }
