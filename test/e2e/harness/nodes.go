package harness

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"syscall"
	"time"
)

// A Cluster's further nodes (AddNode): each is a kubelet and a containerd of its own on this machine,
// registered as a Node of its own. Three things on a machine belong to one kubelet only, and each further
// node gets its own:
//   - the device plugin directory, which the kubelet compiles in (DevicePluginDir): its containerd and kubelet
//     run in a mount namespace of their own, where a directory of the node's is bind-mounted over it. They share
//     that namespace because the kubelet's volume mounts (a projected service account token is a tmpfs) must be
//     the ones containerd hands to the container;
//   - the pod cgroups: the kubelet removes every pod cgroup under its kubepods that it does not know as
//     orphaned, so each node has a --cgroup-root of its own, made in every hierarchy first;
//   - the node address: the kubelet refuses a loopback --node-ip, and a ComputeDomain's IMEX daemons bind
//     their node's InternalIP, so each node gets an address of its own, added to lo for the run.

// NodeOptions is a further node of a Cluster.
type NodeOptions struct {
	// Name is the Node's name (--hostname-override); the node's directories, cgroup root and logs are named
	// after it.
	Name string
	// IP is the kubelet's --node-ip, the Node's InternalIP: added to lo (as a /32) for the run when no
	// interface has it. It must not be a loopback address ("": the kubelet picks the host's).
	IP string
	// Labels are the kubelet's --node-labels.
	Labels map[string]string
}

// furtherNode is what a further node has beyond an Env: its mount namespace, cgroup root and address.
type furtherNode struct {
	cgroupRoot string // e.g. /gpu-agent-e2e-rack1-tray2
	keepLogs   string // where its logs go when the test fails
	release    func() error
}

// containerdArgv runs argv in a new mount namespace (private propagation: nothing mounted there reaches
// the host) in which the node's device plugin directory is bind-mounted over DevicePluginDir. unshare and
// sh exec, so the process is containerd itself, by PID.
func (f *furtherNode) containerdArgv(d dirs, argv []string) []string {
	return append([]string{"unshare", "--mount", "--propagation", "private", "--",
		"sh", "-c", `mount --bind "$0" "$1" && shift && exec "$@"`, d.devicePlugins, DevicePluginDir}, argv...)
}

// kubeletArgv runs argv in containerd's mount namespace (nsenter execs, so the process is the kubelet).
func (f *furtherNode) kubeletArgv(containerd *Process, argv []string) ([]string, error) {
	if containerd == nil {
		return nil, errors.New("kubelet: the node's containerd, whose mount namespace it joins, is not running")
	}
	if done, _ := containerd.Exited(); done {
		return nil, errors.New("kubelet: the node's containerd, whose mount namespace it joins, has exited")
	}
	ns := fmt.Sprintf("--mount=/proc/%d/ns/mnt", containerd.PID())
	return append([]string{"nsenter", ns, "--"}, argv...), nil
}

// cleanup removes the node's cgroup root and address; its processes are gone by then.
func (f *furtherNode) cleanup() error {
	var errs []error
	if err := removeCgroupRoot(f.cgroupRoot); err != nil {
		errs = append(errs, err)
	}
	if f.release != nil {
		errs = append(errs, f.release())
	}
	return errors.Join(errs...)
}

// AddNode starts a further node of the Cluster (see above): a containerd (the Cluster's kind, with the
// Cluster's images) and a kubelet with a node credential of its own, and waits until its Node is Ready and
// untainted. Its teardown is registered with t.Cleanup, so it runs before the Cluster's. It fails t on error.
func (c *Cluster) AddNode(ctx context.Context, opts NodeOptions) *Env {
	t := c.t
	t.Helper()
	e, err := c.addNode(ctx, opts)
	if err != nil {
		t.Fatalf("e2e cluster: node %s: %v", opts.Name, err)
	}
	return e
}

func (c *Cluster) addNode(ctx context.Context, opts NodeOptions) (*Env, error) {
	if opts.Name == "" || opts.Name == c.cfg.NodeName || strings.ContainsAny(opts.Name, "/ ") {
		return nil, fmt.Errorf("want a node name of its own, have %q", opts.Name)
	}
	start := time.Now()
	// Inside the Cluster's run directory: a later run's recoverLedger removes it and ends its shims.
	d := newDirs(filepath.Join(c.d.run, "nodes", opts.Name))
	d.devicePlugins = filepath.Join(d.run, "device-plugins")
	for _, p := range []string{d.logs, d.containerdRoot, d.containerdState, d.cniDir, d.kubeletRoot, d.certs,
		d.manifests, d.podLogs, d.volumePlugins, d.agentState, d.agentMPS, d.cdiSpecs, d.devicePlugins} {
		if err := os.MkdirAll(p, 0o755); err != nil {
			return nil, err
		}
	}
	ports, err := freePorts(2, c.kubeletPort, c.healthzPort, c.APIPort)
	if err != nil {
		return nil, err
	}
	f := &furtherNode{
		cgroupRoot: "/gpu-agent-e2e-" + opts.Name,
		keepLogs:   c.d.run + "." + opts.Name + ".failed",
	}
	e := &Env{t: c.t, d: d, ledger: c.ledger, kubeletPort: ports[0], healthzPort: ports[1], further: f,
		cfg: Config{Kubelet: c.cfg.Kubelet, Images: c.cfg.Images, NodeName: opts.Name, Containerd2: c.cfg.Containerd2}}
	// Registered before anything starts, so that whatever started is ended on every path.
	c.t.Cleanup(e.teardown)
	if err := makeCgroupRoot(f.cgroupRoot); err != nil {
		return nil, err
	}
	if err := os.WriteFile(d.kubeletConfig, []byte(c.kubeletConfig(e)), 0o644); err != nil {
		return nil, err
	}
	c.further++
	if e.podNet, err = c.newPodNetwork(c.further); err != nil {
		return nil, err
	}
	if err := e.setUpNetwork(); err != nil {
		return nil, err
	}
	if opts.IP != "" {
		if f.release, err = addNodeAddress(opts.IP); err != nil {
			return nil, err
		}
	}
	if err := e.startContainerd(ctx); err != nil {
		return nil, err
	}
	if e.kubeletArgs, err = c.kubeletArgs(opts.Name, opts.IP, opts.Labels); err != nil {
		return nil, err
	}
	if err := e.StartKubelet(ctx); err != nil {
		return nil, err
	}
	if err := c.waitNodeReady(ctx, e.kubelet, opts.Name); err != nil {
		return nil, err
	}
	c.t.Logf("e2e cluster: node %s (%s, cgroup root %s, own mount namespace) Ready in %s", opts.Name, opts.IP,
		f.cgroupRoot, time.Since(start).Round(100*time.Millisecond))
	return e, nil
}

// kubeletArgs are the flags a Cluster's kubelet gets beyond the Env's: its credential as Node name, its
// labels and address.
func (c *Cluster) kubeletArgs(name, ip string, labels map[string]string) ([]string, error) {
	cred, err := c.pki.issue("kubelet-"+name, "system:node:"+name, []string{"system:nodes"}, false, nil, nil)
	if err != nil {
		return nil, err
	}
	kubeconfig, err := c.pki.kubeconfig("kubelet-"+name, c.apiURL(), cred)
	if err != nil {
		return nil, err
	}
	args := []string{"--kubeconfig", kubeconfig}
	if len(labels) > 0 {
		var l []string
		for k, v := range labels {
			l = append(l, k+"="+v)
		}
		sort.Strings(l)
		args = append(args, "--node-labels", strings.Join(l, ","))
	}
	if ip != "" {
		args = append(args, "--node-ip", ip)
	}
	return args, nil
}

// writeHostNetworkOnlyCNI writes the network config that makes containerd report the pod network ready
// (without one the kubelet keeps the Node NotReady). Every pod here uses the host network, so no CNI plugin
// ever runs: the config names a plugin that is not installed, and a pod that is not host-network fails loudly
// at sandbox setup.
func writeHostNetworkOnlyCNI(dir string) error {
	cni := `{"cniVersion": "0.4.0", "name": "e2e-host-network-only", "plugins": [{"type": "e2e-pods-must-use-host-network"}]}`
	return os.WriteFile(filepath.Join(dir, "10-e2e.conflist"), []byte(cni+"\n"), 0o644)
}

// NodeDirs are the host paths of a node's kubelet and containerd that a gpu-agent run as a host process for
// that node is pointed at.
type NodeDirs struct {
	// DevicePlugins holds the kubelet's kubelet.sock (--device-plugin-dir).
	DevicePlugins string
	// PodResourcesSocket is the kubelet's pod-resources socket (--pod-resources-socket).
	PodResourcesSocket string
	// KubeletPlugins is the kubelet's plugins directory (--dra-plugin-dir is <it>/gpu.nvidia.com), and
	// PluginsRegistry its plugin registration directory (--kubelet-registry-dir).
	KubeletPlugins, PluginsRegistry string
	// CDISpecs is where the node's containerd reads CDI specs (--cdi-spec-dir); DevRoot the stand-in
	// driver root of a containerd 2.x node (--nvidia-dev-root).
	CDISpecs, DevRoot string
	// Agent is a directory of the node's for the agent's own state, MPS root and logs.
	Agent string
	// Logs is the node's log directory (dumped, and kept, when the test fails).
	Logs string
}

// NodeDirs returns this node's directories (see NodeDirs).
func (e *Env) NodeDirs() NodeDirs {
	return NodeDirs{
		DevicePlugins:      e.d.devicePlugins,
		PodResourcesSocket: e.d.podResources,
		KubeletPlugins:     filepath.Join(e.d.kubeletRoot, "plugins"),
		PluginsRegistry:    filepath.Join(e.d.kubeletRoot, "plugins_registry"),
		CDISpecs:           e.d.cdiSpecs,
		DevRoot:            e.d.devRoot,
		Agent:              filepath.Dir(e.d.agentState),
		Logs:               e.d.logs,
	}
}

// NodeName is the node's name (its kubelet's --hostname-override).
func (e *Env) NodeName() string { return e.cfg.NodeName }

// addNodeAddress puts ip on lo as a /32, unless an interface has it already, and returns what removes it
// again (nothing, if it was there before).
func addNodeAddress(ip string) (func() error, error) {
	addr := net.ParseIP(ip)
	if addr == nil || addr.IsLoopback() || addr.To4() == nil {
		return nil, fmt.Errorf("node address %q: want an IPv4 address outside 127.0.0.0/8 (the kubelet refuses loopback)", ip)
	}
	have, err := net.InterfaceAddrs()
	if err != nil {
		return nil, err
	}
	for _, a := range have {
		if n, ok := a.(*net.IPNet); ok && n.IP.Equal(addr) {
			return func() error { return nil }, nil
		}
	}
	if out, err := exec.Command("ip", "addr", "add", ip+"/32", "dev", "lo").CombinedOutput(); err != nil {
		return nil, fmt.Errorf("ip addr add %s/32 dev lo: %w: %s", ip, err, strings.TrimSpace(string(out)))
	}
	return func() error {
		if out, err := exec.Command("ip", "addr", "del", ip+"/32", "dev", "lo").CombinedOutput(); err != nil {
			return fmt.Errorf("ip addr del %s/32 dev lo: %w: %s", ip, err, strings.TrimSpace(string(out)))
		}
		return nil
	}, nil
}

// cgroupMounts lists the mount points of the cgroup hierarchies (v1 and v2) from /proc/self/mountinfo.
func cgroupMounts() ([]string, error) {
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return nil, err
	}
	return parseCgroupMounts(string(b)), nil
}

// parseCgroupMounts reads the mount points whose filesystem type (the first field after " - ") is cgroup or
// cgroup2 from mountinfo.
func parseCgroupMounts(mountinfo string) []string {
	var out []string
	for _, line := range strings.Split(mountinfo, "\n") {
		_, after, ok := strings.Cut(line, " - ")
		f := strings.Fields(line)
		if !ok || len(f) < 5 {
			continue
		}
		if fstype := strings.Fields(after); len(fstype) > 0 && (fstype[0] == "cgroup" || fstype[0] == "cgroup2") {
			out = append(out, unescapeMountinfo(f[4]))
		}
	}
	return out
}

// makeCgroupRoot creates root in every cgroup hierarchy (the kubelet refuses a --cgroup-root missing from
// one). A new v1 cpuset group starts with no CPUs and no memory nodes, and no task may join it then: it gets
// its parent's.
func makeCgroupRoot(root string) error {
	mounts, err := cgroupMounts()
	if err != nil {
		return err
	}
	for _, mp := range mounts {
		dir := filepath.Join(mp, root)
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return fmt.Errorf("cgroup root %s: %w", dir, err)
		}
		for _, file := range []string{"cpuset.cpus", "cpuset.mems"} {
			parent, err := os.ReadFile(filepath.Join(mp, file))
			if errors.Is(err, fs.ErrNotExist) {
				continue // not the cpuset hierarchy
			}
			if err != nil {
				return fmt.Errorf("cgroup root %s: %w", dir, err)
			}
			if cur, err := os.ReadFile(filepath.Join(dir, file)); err == nil && strings.TrimSpace(string(cur)) != "" {
				continue
			}
			if err := os.WriteFile(filepath.Join(dir, file), parent, 0o644); err != nil {
				return fmt.Errorf("cgroup root %s: %s: %w", dir, file, err)
			}
		}
	}
	return nil
}

// removeCgroupRoot removes root and every group below it from every hierarchy, deepest first (a group goes
// only once it has no children and no tasks).
func removeCgroupRoot(root string) error {
	mounts, err := cgroupMounts()
	if err != nil {
		return err
	}
	var errs []error
	for _, mp := range mounts {
		var groups []string
		_ = filepath.WalkDir(filepath.Join(mp, root), func(p string, d fs.DirEntry, err error) error {
			if err == nil && d.IsDir() {
				groups = append(groups, p)
			}
			return nil
		})
		sort.SliceStable(groups, func(i, j int) bool { return len(groups[i]) > len(groups[j]) })
		for _, g := range groups {
			if err := syscall.Rmdir(g); err != nil && !errors.Is(err, syscall.ENOENT) {
				errs = append(errs, fmt.Errorf("remove cgroup %s: %w", g, err))
			}
		}
	}
	return errors.Join(errs...)
}
