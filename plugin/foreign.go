package plugin

import (
	"net"
	"os"
	"path/filepath"
	"strings"
	"time"
)

// ForeignSockets lists the resources NVIDIA's device plugin serves through
// dir (the kubelet's device plugin directory): its sockets are named
// nvidia-<name>.sock for resource nvidia.com/<name>. The directory is what
// the kubelet itself dials, so it is the one place that says which plugin
// serves what on this kubelet: the Node's capacity does not say who
// registered a resource, nor does pod-resources. A socket nobody listens
// on (a plugin that died without removing it) is left out. gpu-agent's own
// sockets are named gpu-agent-*.sock (DefaultSocketName).
func ForeignSockets(dir string) map[string]string {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return nil
	}
	out := map[string]string{}
	for _, e := range entries {
		name, ok := strings.CutSuffix(e.Name(), ".sock")
		if !ok || e.Type()&os.ModeSocket == 0 {
			continue
		}
		res, ok := strings.CutPrefix(name, "nvidia-")
		if !ok || res == "" {
			continue
		}
		path := filepath.Join(dir, e.Name())
		c, err := net.DialTimeout("unix", path, 100*time.Millisecond)
		if err != nil {
			continue
		}
		c.Close()
		out["nvidia.com/"+res] = path
	}
	return out
}
