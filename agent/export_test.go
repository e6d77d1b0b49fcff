package agent

import "github.com/gpu-agent/gpu-agent/catalog"

// preferrerForTest reads the cached preferrer; only safe once Run has
// published (the test reads it after, with no reconcile in flight).
func (a *Agent) preferrerForTest() catalog.Preferrer { return a.pref }
