package v1beta1

import "k8s.io/apimachinery/pkg/runtime"

// DeepCopyInto copies in into out.
func (in *ComputeDomain) DeepCopyInto(out *ComputeDomain) {
	*out = *in
	out.TypeMeta = in.TypeMeta
	in.ObjectMeta.DeepCopyInto(&out.ObjectMeta)
	in.Spec.DeepCopyInto(&out.Spec)
	in.Status.DeepCopyInto(&out.Status)
}

// DeepCopy returns a copy of in.
func (in *ComputeDomain) DeepCopy() *ComputeDomain {
	if in == nil {
		return nil
	}
	out := new(ComputeDomain)
	in.DeepCopyInto(out)
	return out
}

// DeepCopyObject implements [runtime.Object].
func (in *ComputeDomain) DeepCopyObject() runtime.Object {
	if c := in.DeepCopy(); c != nil {
		return c
	}
	return nil
}

// DeepCopyInto copies in into out.
func (in *ComputeDomainSpec) DeepCopyInto(out *ComputeDomainSpec) {
	*out = *in
	if in.Channel != nil {
		c := *in.Channel
		out.Channel = &c
	}
}

// DeepCopyInto copies in into out.
func (in *ComputeDomainStatus) DeepCopyInto(out *ComputeDomainStatus) {
	*out = *in
	if in.Nodes != nil {
		out.Nodes = make([]ComputeDomainNode, len(in.Nodes))
		copy(out.Nodes, in.Nodes)
	}
}

// DeepCopyInto copies in into out.
func (in *ComputeDomainList) DeepCopyInto(out *ComputeDomainList) {
	*out = *in
	out.TypeMeta = in.TypeMeta
	in.ListMeta.DeepCopyInto(&out.ListMeta)
	if in.Items != nil {
		out.Items = make([]ComputeDomain, len(in.Items))
		for i := range in.Items {
			in.Items[i].DeepCopyInto(&out.Items[i])
		}
	}
}

// DeepCopy returns a copy of in.
func (in *ComputeDomainList) DeepCopy() *ComputeDomainList {
	if in == nil {
		return nil
	}
	out := new(ComputeDomainList)
	in.DeepCopyInto(out)
	return out
}

// DeepCopyObject implements [runtime.Object].
func (in *ComputeDomainList) DeepCopyObject() runtime.Object {
	if c := in.DeepCopy(); c != nil {
		return c
	}
	return nil
}
