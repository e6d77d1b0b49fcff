package harness

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"
)

// containerdConfig renders containerd 1.6's config for a private instance: its own root, state and sockets
// under dir, the CRI plugin pointed at the local pause image, runc with cgroupfs.
func containerdConfig(d dirs) string {
	// restrict_oom_score_adj: root in this sandbox lacks CAP_SYS_RESOURCE, so runc fails to set the
	// kubelet's oom_score_adj of -998 on the sandbox unless containerd clamps it to its own value.
	// The CNI dirs are empty on purpose: pods use the host network, and the host's CNI setup stays out.
	return fmt.Sprintf(`version = 2
root = %q
state = %q

[grpc]
  address = %q

[ttrpc]
  address = %q

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = %q
  restrict_oom_score_adj = true
  enable_selinux = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = %q
    conf_dir = %q
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
`, d.containerdRoot, d.containerdState, d.containerdSock, d.containerdSock+".ttrpc",
		"docker.io/"+PauseImage, d.cniDir, d.cniDir)
}

// containerd2Config renders containerd 2.x's config (version 3) for a private instance, as containerdConfig
// does for 1.6, with CDI specs read from the Env's own spec directory only (CDI is always on in 2.x) and the
// runc shim of the same build.
func containerd2Config(d dirs, shim string) string {
	return fmt.Sprintf(`version = 3
root = %q
state = %q

[grpc]
  address = %q

[ttrpc]
  address = %q

[plugins."io.containerd.cri.v1.images"]
  snapshotter = "overlayfs"
  [plugins."io.containerd.cri.v1.images".pinned_images]
    sandbox = %q

[plugins."io.containerd.cri.v1.runtime"]
  restrict_oom_score_adj = true
  enable_selinux = false
  cdi_spec_dirs = [%q]
  # A pod off the host network (ClusterConfig.PodNetwork) gets its network namespace mounted under the state
  # directory, so the teardown's unmount of the run directory takes it, not under the host's /var/run/netns.
  netns_mounts_under_state_dir = true
  [plugins."io.containerd.cri.v1.runtime".cni]
    bin_dirs = [%q]
    conf_dir = %q
  [plugins."io.containerd.cri.v1.runtime".containerd]
    default_runtime_name = "runc"
    [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      runtime_path = %q
      [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc.options]
        SystemdCgroup = false

# NRI's socket of this instance, not the host's /var/run/nri/nri.sock, which a second containerd (a Cluster's
# further node) would take over.
[plugins."io.containerd.nri.v1.nri"]
  socket_path = %q
`, d.containerdRoot, d.containerdState, d.containerdSock, d.containerdSock+".ttrpc",
		"docker.io/"+PauseImage, d.cdiSpecs, d.cniDir, d.cniDir, shim, filepath.Join(filepath.Dir(d.containerdSock), "nri.sock"))
}

// kubeletConfig renders a KubeletConfiguration for a standalone kubelet (no API server): static pods only,
// anonymous read access on 127.0.0.1 so the suite can GET /pods, cgroup v1 allowed.
func kubeletConfig(d dirs, port, healthzPort int) string {
	// fileCheckFrequency: the kubelet also watches staticPodPath with inotify, but the periodic re-list is
	// what catches a missed event; 1s keeps a missed one from costing 20s.
	// Eviction thresholds are near zero so a busy shared disk never evicts the suite's pods.
	return fmt.Sprintf(`apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
failCgroupV1: false
cgroupDriver: cgroupfs
address: 127.0.0.1
port: %d
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: %d
authentication:
  anonymous:
    enabled: true
  webhook:
    enabled: false
authorization:
  mode: AlwaysAllow
staticPodPath: %q
fileCheckFrequency: 1s
syncFrequency: 10s
containerRuntimeEndpoint: %q
podLogsDir: %q
volumePluginDir: %q
evictionHard:
  memory.available: "1Mi"
  nodefs.available: "1%%"
  imagefs.available: "1%%"
  nodefs.inodesFree: "1%%"
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
failSwapOn: false
`, port, healthzPort, d.manifests, "unix://"+d.containerdSock, d.podLogs, d.volumePlugins)
}

// writeConfigMap writes content as key inside dir the way the kubelet projects a ConfigMap volume: the data
// lives in a timestamped directory, `..data` is a symlink to it, and key is a symlink through `..data`. A
// later call swaps `..data` atomically with rename(2), which is the event gpu-agent's watcher must handle.
func writeConfigMap(dir, key, content string, now time.Time) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return fmt.Errorf("configmap %s: %w", dir, err)
	}
	ts := "..0_" + now.Format("2006_01_02_15_04_05.000000000")
	if err := os.Mkdir(filepath.Join(dir, ts), 0o755); err != nil {
		return fmt.Errorf("configmap %s: %w", dir, err)
	}
	if err := os.WriteFile(filepath.Join(dir, ts, key), []byte(content), 0o644); err != nil {
		return fmt.Errorf("configmap %s: %w", dir, err)
	}
	old, _ := os.Readlink(filepath.Join(dir, "..data"))
	tmp := filepath.Join(dir, "..data_tmp")
	_ = os.Remove(tmp)
	if err := os.Symlink(ts, tmp); err != nil {
		return fmt.Errorf("configmap %s: %w", dir, err)
	}
	if err := os.Rename(tmp, filepath.Join(dir, "..data")); err != nil {
		return fmt.Errorf("configmap %s: swap ..data: %w", dir, err)
	}
	link := filepath.Join(dir, key)
	if _, err := os.Lstat(link); err != nil {
		if err := os.Symlink(filepath.Join("..data", key), link); err != nil {
			return fmt.Errorf("configmap %s: %w", dir, err)
		}
	}
	if old != "" && old != ts && strings.HasPrefix(old, "..") {
		if err := os.RemoveAll(filepath.Join(dir, old)); err != nil {
			return fmt.Errorf("configmap %s: remove old data: %w", dir, err)
		}
	}
	return nil
}
