package agent

import (
	"slices"

	"github.com/gpu-agent/gpu-agent/config"
)

// BuiltInConfigName names the built-in default where /status and the log
// say what is served: the implicit default of config.BuiltIn.
const BuiltInConfigName = "built-in default"

// reasonBuiltIn is why the built-in default is selected.
const reasonBuiltIn config.SelectReason = "no config applies"

// builtInSummary says what the built-in default serves, for messages.
const builtInSummary = "whole GPUs and the MIG devices that exist, no sharing"

// builtInSelection is the built-in default as a selection: what the node
// serves while no config applies. It never fails to plan (no sharing), so
// a node that has GPUs always offers them.
func builtInSelection(o config.ParseOptions) config.Selected {
	f := config.BuiltIn(o)
	return config.Selected{Name: BuiltInConfigName, Reason: reasonBuiltIn, Config: f.Configs[config.DefaultConfigName]}
}

// parseOptions are the agent's settings that reading a config depends on.
func (a *Agent) parseOptions() config.ParseOptions {
	return config.ParseOptions{MIGStrategy: a.opts.MIGStrategy}
}

// serveBuiltIn puts the built-in default in force after the first config
// content was rejected: the node serves its GPUs while the error says why
// it serves no more.
func (a *Agent) serveBuiltIn() {
	a.file, a.warnings = config.BuiltIn(a.parseOptions()), nil
	a.selectConfig()
}

// serving names what the node serves when it is not the config selected
// for it ("" when it is): the last config that fitted, or the built-in
// default when no config has applied since start.
func (a *Agent) serving() string {
	switch {
	case a.file == nil:
		return ""
	case a.fitErr.stands() && a.lastGood.Config != nil:
		return a.lastGood.Name
	case (a.cfgErr.stands() || a.selErr.stands()) && (a.selected.Name == BuiltInConfigName || (a.opts.WaitForConfig && a.gen == 0)):
		// Rejected, or selecting nothing, before any config applied.
		return BuiltInConfigName
	}
	return ""
}

// notePlanWarnings keeps the plan's warnings for /status and logs those
// that are new, so a resync does not repeat them.
func (a *Agent) notePlanWarnings(ws []string) {
	if slices.Equal(ws, a.planWarnings) {
		return
	}
	for _, w := range ws {
		if !slices.Contains(a.planWarnings, w) {
			a.log.Warn("config warning", "config", a.selected.Name, "warning", w)
		}
	}
	a.planWarnings = slices.Clone(ws)
}
