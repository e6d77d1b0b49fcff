package harness

import (
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strings"

	appsv1 "k8s.io/api/apps/v1"
	"sigs.k8s.io/yaml"
)

// daemonSetManifest is the DaemonSet users install (deploy/manifests): the
// suite runs gpu-agent with its args, env and mounts, so what CI proves is
// what users run.
func daemonSetManifest() string {
	_, file, _, _ := runtime.Caller(0)
	return filepath.Join(filepath.Dir(file), "..", "..", "..", "deploy", "manifests", "daemonset.yaml")
}

// daemonSetArgs returns the DaemonSet container's args and plain env, with
// every path inside a volume mount moved to where this Env keeps that volume
// (the device plugin directory stays the kubelet's own). --listen gets the
// Env's address; --config is left out when the Env has no config file.
func daemonSetArgs(e *Env) (args, env []string, err error) {
	data, err := os.ReadFile(daemonSetManifest())
	if err != nil {
		return nil, nil, err
	}
	var ds appsv1.DaemonSet
	if err := yaml.Unmarshal(data, &ds); err != nil {
		return nil, nil, fmt.Errorf("%s: %w", daemonSetManifest(), err)
	}
	if n := len(ds.Spec.Template.Spec.Containers); n != 1 {
		return nil, nil, fmt.Errorf("%s: %d containers, want 1", daemonSetManifest(), n)
	}
	c := ds.Spec.Template.Spec.Containers[0]
	volumes := map[string]string{
		DevicePluginDir:                  DevicePluginDir,
		"/var/lib/kubelet/pod-resources": filepath.Dir(e.d.podResources),
		"/var/lib/gpu-agent":             e.d.agentState,
		"/run/gpu-agent/mps":             e.d.agentMPS,
		"/etc/gpu-agent":                 e.d.agentConfigDir,
		"/var/run/cdi":                   e.d.cdiSpecs,
		// The host's /proc, read-only, for the holder tracker: the agent
		// runs on the host here, so it is /proc itself.
		"/host/proc": "/proc",
	}
	for _, m := range c.VolumeMounts {
		if _, ok := volumes[m.MountPath]; !ok {
			return nil, nil, fmt.Errorf("DaemonSet mounts %s, which the suite does not map", m.MountPath)
		}
	}
	rebase := func(p string) string {
		for mount, dir := range volumes {
			if p == mount || strings.HasPrefix(p, mount+"/") {
				return dir + strings.TrimPrefix(p, mount)
			}
		}
		return p
	}
	for _, a := range c.Args {
		name, val, ok := strings.Cut(a, "=")
		switch {
		case !ok:
			args = append(args, a)
		case name == "--listen":
			args = append(args, name+"="+e.agentAddr)
		case name == "--config" && e.cfg.AgentConfig == "":
		default:
			args = append(args, name+"="+rebase(val))
		}
	}
	for _, v := range c.Env {
		switch {
		case v.Name == "NODE_NAME":
			env = append(env, "NODE_NAME="+e.cfg.NodeName) // the downward API's spec.nodeName
		case v.ValueFrom == nil:
			env = append(env, v.Name+"="+v.Value)
		}
	}
	return args, env, nil
}
