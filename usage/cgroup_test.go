package usage

import (
	"strings"
	"testing"
)

const (
	uid    = "6b0e3c1a-58d2-4f7e-9a41-2c8d5f0b7e93"
	uidSD  = "6b0e3c1a_58d2_4f7e_9a41_2c8d5f0b7e93" // as the systemd driver writes it
	static = "03c7c0ace395d80182db07ae2c30f034"     // a static pod's UID: a hash
	cid    = "ca978112ca1bbdcafac231b39a23dc4da786eff8147c4e72b9807785afee48bb"
	cid2   = "3e23e8160039594a33894f6564e1b1348bbd7a0088d42c4acb73eeaed59c009d"
)

// TestParseCgroup: /proc/<pid>/cgroup as nodes write it, per cgroup
// version, driver and runtime.
func TestParseCgroup(t *testing.T) {
	containerd := Owner{PodUID: uid, ContainerID: cid, Runtime: "containerd"}
	crio := Owner{PodUID: uid, ContainerID: cid, Runtime: "cri-o"}
	cgroupfs := Owner{PodUID: uid, ContainerID: cid}
	tests := []struct {
		name    string
		content string
		want    Owner
	}{
		{"v2 systemd containerd burstable",
			"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod" + uidSD + ".slice/cri-containerd-" + cid + ".scope\n",
			containerd},
		{"v2 systemd containerd guaranteed (no QoS level)",
			"0::/kubepods.slice/kubepods-pod" + uidSD + ".slice/cri-containerd-" + cid + ".scope\n",
			containerd},
		{"v2 systemd CRI-O besteffort",
			"0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod" + uidSD + ".slice/crio-" + cid + ".scope\n",
			crio},
		{"v2 systemd under a kubelet slice",
			"0::/kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-besteffort.slice/kubelet-kubepods-besteffort-pod" + uidSD + ".slice/cri-containerd-" + cid + ".scope\n",
			containerd},
		{"v2 read from another cgroup namespace",
			"0::/../../kubepods-burstable-pod" + uidSD + ".slice/cri-containerd-" + cid + ".scope\n",
			containerd},
		{"v2 a child cgroup the container made",
			"0::/kubepods.slice/kubepods-pod" + uidSD + ".slice/cri-containerd-" + cid + ".scope/init.scope\n",
			containerd},
		{"v2 cgroupfs",
			"0::/kubepods/burstable/pod" + uid + "/" + cid + "\n",
			cgroupfs},
		{"v2 cgroupfs guaranteed",
			"0::/kubepods/pod" + uid + "/" + cid + "\n",
			cgroupfs},
		{"v2 cgroupfs static pod",
			"0::/kubepods/besteffort/pod" + static + "/" + cid + "\n",
			Owner{PodUID: static, ContainerID: cid}},
		{"v2 systemd static pod",
			"0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod" + static + ".slice/cri-containerd-" + cid + ".scope\n",
			Owner{PodUID: static, ContainerID: cid, Runtime: "containerd"}},
		{"v2 the pod's own cgroup",
			"0::/kubepods.slice/kubepods-pod" + uidSD + ".slice\n",
			Owner{PodUID: uid}},
		{"v2 CRI-O conmon is not the container",
			"0::/kubepods.slice/kubepods-pod" + uidSD + ".slice/crio-conmon-" + cid + ".scope\n",
			Owner{PodUID: uid}},
		{"v1 systemd, one line per controller",
			"12:hugetlb:/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod" + uidSD + ".slice/cri-containerd-" + cid + ".scope\n" +
				"11:memory:/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod" + uidSD + ".slice/cri-containerd-" + cid + ".scope\n" +
				"10:cpu,cpuacct:/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod" + uidSD + ".slice/cri-containerd-" + cid + ".scope\n" +
				"1:name=systemd:/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod" + uidSD + ".slice/cri-containerd-" + cid + ".scope\n" +
				"0::/\n",
			containerd},
		{"v1 cgroupfs, the pod only in some hierarchies",
			"13:rdma:/\n" +
				"12:devices:/kubepods/besteffort/pod" + uid + "/" + cid + "\n" +
				"11:pids:/kubepods/besteffort/pod" + uid + "/" + cid + "\n",
			cgroupfs},
		{"v1 Docker through cri-dockerd",
			"4:memory:/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod" + uidSD + ".slice/docker-" + cid + ".scope\n",
			Owner{PodUID: uid, ContainerID: cid, Runtime: "docker"}},
		{"CRLF line ends",
			"0::/kubepods/pod" + uid + "/" + cid + "\r\n",
			cgroupfs},
		{"a container outside Kubernetes",
			"0::/system.slice/docker-" + cid + ".scope\n",
			Owner{ContainerID: cid, Runtime: "docker"}},
		{"a host service", "0::/system.slice/nvidia-persistenced.service\n", Owner{}},
		{"a login session", "0::/user.slice/user-1000.slice/session-4.scope\n", Owner{}},
		{"a bare ID outside a pod is no container", "0::/machine/" + cid + "\n", Owner{}},
		{"empty", "", Owner{}},
		{"pod UID too short", "0::/kubepods/pod6b0e3c1a-58d2/" + cid + "\n", Owner{}},
		{"pod UID upper case", "0::/kubepods/pod" + strings.ToUpper(uid) + "/" + cid + "\n", Owner{}},
		{"pod UID with dashes misplaced", "0::/kubepods/pod6b0e3c1a5-8d2-4f7e-9a41-2c8d5f0b7e93/" + cid + "\n", Owner{}},
		{"container ID too short", "0::/kubepods/pod" + uid + "/" + cid[:63] + "\n", Owner{PodUID: uid}},
		{"the first container wins", "0::/kubepods/pod" + uid + "/" + cid + "/" + cid2 + "\n", cgroupfs},
		{"no path", "0:\n", Owner{}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := ParseCgroup(tt.content); got != tt.want {
				t.Errorf("got %+v, want %+v", got, tt.want)
			}
		})
	}
}

// FuzzParseCgroup: any content parses to an owner whose pod UID and
// container ID have the forms the kubelet and runtimes give them, and that
// the lines a node would write for that owner parse back to it.
func FuzzParseCgroup(f *testing.F) {
	f.Add("0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod" + uidSD + ".slice/cri-containerd-" + cid + ".scope\n")
	f.Add("12:memory:/kubepods/besteffort/pod" + uid + "/" + cid + "\n0::/\n")
	f.Add("0::/../kubepods-pod" + uidSD + ".slice/crio-" + cid + ".scope")
	f.Add("0::/system.slice/docker-" + cid + ".scope\n")
	f.Add("0::/kubepods/pod" + static + "/" + cid + "\r\n")
	f.Add("0::/kubepods-pod_.slice/-pod.slice/pod/crio-.scope")
	f.Fuzz(func(t *testing.T, content string) {
		o := ParseCgroup(content)
		if o.PodUID != "" && !podUID(o.PodUID) {
			t.Fatalf("pod UID %q", o.PodUID)
		}
		if o.ContainerID != "" && !containerID(o.ContainerID) {
			t.Fatalf("container ID %q", o.ContainerID)
		}
		if o.Runtime != "" && o.ContainerID == "" {
			t.Fatalf("a runtime without a container: %+v", o)
		}
		if o.PodUID == "" && o.ContainerID != "" && o.Runtime == "" {
			t.Fatalf("a bare container ID outside a pod: %+v", o)
		}
		if got := ParseCgroup(lineOf(o)); got != o {
			t.Fatalf("%+v written as %q parses to %+v", o, lineOf(o), got)
		}
	})
}

// lineOf is the cgroup v2 line a node using the systemd driver (or
// cgroupfs, for a container of no named runtime) writes for o.
func lineOf(o Owner) string {
	path := "/kubepods.slice"
	switch {
	case o.PodUID != "" && o.Runtime == "" && o.ContainerID != "":
		return "0::/kubepods/pod" + o.PodUID + "/" + o.ContainerID + "\n"
	case o.PodUID != "":
		path += "/kubepods-burstable.slice/kubepods-burstable-pod" + strings.ReplaceAll(o.PodUID, "-", "_") + ".slice"
	default:
		path = "/system.slice"
	}
	for _, p := range scopePrefixes {
		if p.runtime == o.Runtime && o.ContainerID != "" {
			path += "/" + p.prefix + o.ContainerID + ".scope"
		}
	}
	return "0::" + path + "\n"
}
