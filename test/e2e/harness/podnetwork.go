package harness

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
)

// CNIPluginDir is where Debian's containernetworking-plugins installs the reference CNI plugins (run.sh
// installs the package).
const CNIPluginDir = "/usr/lib/cni"

// podNetwork is a node's own pod network, for a Cluster whose pods do not all use the host network
// (ClusterConfig.PodNetwork): manifests written for real clusters, such as NVIDIA's demos, which the tests apply
// unchanged. It is the reference CNI plugins' bridge with host-local addresses: a Linux bridge of the node's on
// this machine, no address on it, no route, no masquerading and no iptables rule, so a pod gets a network
// namespace with its loopback and an eth0 that reaches the other pods of its node and nothing else. That is
// all containerd needs to start the pod (it wants an address on eth0), and all these tests need.
type podNetwork struct {
	bridge string // e2e-pods<i>: at most 15 bytes, an interface name's limit
	subnet string // 10.88.<i>.0/24, one per node of the Cluster, so no two pods have one address
}

func newPodNetwork(i int) (*podNetwork, error) {
	if i < 0 || i > 255 {
		return nil, fmt.Errorf("pod network %d: want 0 to 255", i)
	}
	return &podNetwork{bridge: fmt.Sprintf("e2e-pods%d", i), subnet: fmt.Sprintf("10.88.%d.0/24", i)}, nil
}

// conflist is the network config containerd loads: the bridge and, as containerd always adds, loopback.
// host-local keeps its leases in the node's run directory, not the host's /var/lib/cni.
func (n *podNetwork) conflist(ipamDir string) string {
	return fmt.Sprintf(`{"cniVersion": "0.4.0", "name": "e2e-pods", "plugins": [{"type": "bridge", "bridge": %q,
  "isGateway": false, "ipMasq": false, "hairpinMode": false,
  "ipam": {"type": "host-local", "dataDir": %q, "ranges": [[{"subnet": %q}]]}}]}
`, n.bridge, ipamDir, n.subnet)
}

// setUp makes d's CNI directory, which containerd reads both as its config and its plugin directory, hold the
// network's config and the three plugins it runs (symlinks to CNIPluginDir).
func (n *podNetwork) setUp(d dirs) error {
	for _, p := range []string{"bridge", "host-local", "loopback"} {
		src := filepath.Join(CNIPluginDir, p)
		if _, err := os.Stat(src); err != nil {
			return fmt.Errorf("pod network: CNI plugin %s: %w (apt-get install containernetworking-plugins; run.sh does)", p, err)
		}
		if err := os.Symlink(src, filepath.Join(d.cniDir, p)); err != nil {
			return fmt.Errorf("pod network: %w", err)
		}
	}
	return os.WriteFile(filepath.Join(d.cniDir, "10-e2e.conflist"), []byte(n.conflist(filepath.Join(d.run, "cni-ipam"))), 0o644)
}

// release removes the node's bridge, which the bridge plugin made on this machine's network and nothing else
// removes; the pods' ends of their veth pairs went with their network namespaces.
func (n *podNetwork) release() error {
	if err := exec.Command("ip", "link", "show", "dev", n.bridge).Run(); err != nil {
		return nil // never made: no pod of the node left the host network
	}
	if out, err := exec.Command("ip", "link", "del", "dev", n.bridge).CombinedOutput(); err != nil {
		return fmt.Errorf("pod network: ip link del %s: %w: %s", n.bridge, err, strings.TrimSpace(string(out)))
	}
	return nil
}

// setUpNetwork writes e's CNI config: its pod network's when it has one, else the host-network-only one.
func (e *Env) setUpNetwork() error {
	if e.podNet == nil {
		return writeHostNetworkOnlyCNI(e.d.cniDir)
	}
	if e.cfg.Containerd2 == "" {
		return errors.New("pod network: only on containerd 2.x (Containerd2), whose network namespaces the harness keeps under its run directory")
	}
	return e.podNet.setUp(e.d)
}
